"""The GPU bench of issue 28 (run as ``python -m benchmarks.gpu_bench``), one module per concept: both processes'
set-up (``ranks``), where the caches live (``memory``), the prefill process (``prefill``, ``child``), decode's side
(``decode``), the rows' runners (``runners``), the schedule (``bench``), the UCX path of each row (``paths``), the
issue's targets (``targets``) and the table (``report``)."""
