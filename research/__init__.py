"""One-off probes and GPU drivers: each answered a question once, and opens with that question and where its answer
is recorded. Their tests run in the default CPU suite: the probes import the package's kernels."""
