"""Sharding expansion: rules as data (``rules.toml``), the sharding of one value
(:class:`~flint.sharding.spec.Sharding`) and the propagation engine
(:mod:`flint.sharding.engine`) behind the ``shard-annotate`` and ``shard-expand``
passes."""
