"""The FRoD layer: ``FRoDLinear`` and its autograd Function, quantized frozen factors, the method's names."""
