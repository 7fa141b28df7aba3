"""The measurements a suite's configurations run (a suite's ``kind``)."""
