"""Built-in tasks with their gold judges: the tiny toy task (`toy`), the demo's reviews task (`reviews`), and single-digit
sums with a reference answer per record (`arithmetic`, the worked example of a reward function reading a record field);
and the offline end-to-end demo on the reviews task (`demo`, `rlhfkit demo`)."""
