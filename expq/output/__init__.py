"""Laying down a conversion's output: ``outdir`` (``OutputDir``: the staging folder beside OUT, the journal that
makes a killed run resumable, the lock, recovery and the one commit point; ``reading``, the readers' lock),
``shards`` (``ShardSet``: the output shards written positionally and hashed as they fill; placeholders;
config.json) and ``faults`` (the ``EXPQ_FAULT`` test seam both pass through).
"""
