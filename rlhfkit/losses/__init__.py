"""Pure loss functions (torch only): tensors and scalars in, (loss, detached metrics) out.

Most return the loss unreduced, per token or per example, and the trainer reduces it with global counts (a per-token
loss through `aggregate`, the one place one is reduced). Two reduce it themselves, by a normaliser the caller passes:
`sft.sft_loss` (token-mean through `aggregate`) and `online_preference.online_pair_loss` (sum over kept pairs /
`num_pairs`).
"""
