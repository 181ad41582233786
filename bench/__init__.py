"""Every `pdserve bench KIND`, one module per kind, and the list that registers them (`BENCHES`):
pyproject.toml names it in the `pdserve.bench` entry-point group, where the CLI finds it
(deploy/plugins.py), so deploy/ imports no benchmark.

Each kind's module has `add_arguments(parser)` and `run(args)`; it is imported only when run,
so one benchmark's dependencies (ucxx for kv; the `bench` extra's, bench/extras.py) never stop
the others. bench/gpu/run.sh drives these on a device machine (bench/cpu/: the many-core CPU
one, and the masked argmax's machine code compiled here), and bench/results/ holds the reports
and plots that BENCHMARKS.md cites.
"""

# (name, module, one line for `pdserve bench --help`)
BENCHES = [
    ("engine", "bench.engine", "single-process engine throughput (k = 0 and k)"),
    ("prefill", "bench.prefill", "time to first token in one process (k = 0 and k), HF forward and the floor"),
    ("kv", "bench.kv", "KV transfer bandwidth between two processes"),
    ("acceptance", "bench.acceptance", "MTP draft acceptance and tokens/s on held-out prompts (k = 0 vs k)"),
    ("pd", "bench.pd", "disaggregated (prefill + decode node) vs colocated: TTFT and ITL, same requests"),
    ("serve", "bench.serve", "load a router (gRPC or HTTP): TTFT/ITL/e2e percentiles, goodput, plots"),
    ("host", "bench.host", "the host path alone: a router in front of synthetic nodes (no model), or of one "
     "real colocated node (--node-model tiny: its CPU per token, model compute vs host path): output "
     "tokens/s and the router's CPU per token"),
    ("prefix", "bench.prefix", "multi-turn chat on a local service without and with the prefix cache + "
     "prefix routing: TTFT, prefill tokens computed"),
    ("chaos", "bench.chaos", "faults together under load on a local service (node kills, Abort storms, "
     "client cancels, 2x overload): sent / correct / clean error / lost / duplicated / leaked blocks"),
    ("structured", "bench.structured", "JSON-schema outputs (a server's HTTP API, or in-process k = 0 vs k): "
     "parsed and schema-valid shares, output tokens, MTP acceptance with and without the constraint"),
]
