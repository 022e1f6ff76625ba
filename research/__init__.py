"""One-off probes and GPU drivers: each answered a question once, and opens with that question and where its answer
is recorded. Not part of the default test paths: `pytest research` runs their tests."""
