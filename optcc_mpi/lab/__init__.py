"""The lab: experiment tooling (benchmarks, sweeps, reports, the testbed, launching).

Built on the core library, which never imports it.
"""
