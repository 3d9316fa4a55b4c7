"""edgefl's benchmarks (``python -m bench.<name>``; results and commands in ``docs/benchmarks.md``).

A benchmark that runs the coordinator or device code in its own process runs it with the process
settings ``edgefl`` sets for itself (:mod:`edgefl.cli`: one BLAS thread, the malloc knobs), so they are
in place before numpy loads. Without them OpenBLAS starts a worker thread per core that spin-waits
between matrix products: in ``bench.peer`` the in-process coordinator used 17-26 ms of CPU per
~25 ms round on this 2-vCPU machine, taken from the devices beside it.
"""

import edgefl.cli  # noqa: F401  (sets OPENBLAS_NUM_THREADS etc., as the shipped command does)
