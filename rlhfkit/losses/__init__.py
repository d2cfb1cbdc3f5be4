"""Pure loss functions (torch only): tensors and scalars in, (unreduced loss, detached metrics) out."""
