"""Between ranks: each rank's window reports over the job's store (``rank_tree``, ``rank_node``, ``rank_reader``),
their exchange (``ranks``), the job's totals (``rank_summary``) and the per-rank table (``rank_view``)."""
