"""Old module paths kept for one release (frod_ds/_moved.py): files on a package's __path__, not a package API."""
