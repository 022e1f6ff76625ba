"""`sdsie serve`: an OpenAI-compatible server where the clutch's decision acts, per request.

    pip install 'sdsie[serve]'
    sdsie serve --target reproductions/standin/cpu/target --scout reproductions/standin/cpu/scout \\
        --tokenizer reproductions/standin/cpu/tokenizer --clutch production --port 8000
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "def main(", "max_tokens": 32, "temperature": 0}'

Batch 1: requests wait in a bounded FIFO queue and run one at a time through sdsie.decoding.generate, in the
engine's own process (sdsie.serve.process) beside the HTTP server's.
`usage.sdsie` reports what the engine did for the request (cycles, speculate cycles, drafts, acceptances,
the decisions string, the INT4 gear's share of target forwards, energy in J where NVML measured it).
"""

from sdsie.serve.config import ServeConfig, parse_clutch

__all__ = ["ServeConfig", "parse_clutch"]
