"""``verify``'s checks, each a small function over one ``checkpoint.ConvertedCheckpoint`` (and the source's plan
where it needs one) returning its record: ``record.py`` (the records and how findings are kept), ``structure.py``
(expq.json, OUT's files, index and shards, loading, quantization_config, every expert present), ``experts.py``
(codes and scales; bits, row error and the other tensors against the source), ``kernel.py`` (the fused-MoE kernel
against its fp32 reference and the source experts) and ``thresholds.py`` (the limits, with their reasoning).
``verifier.verify`` runs them in order and writes the report."""
