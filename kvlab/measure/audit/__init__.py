"""Audits of a store's own merge, shift and cache files (``kvlab certify MODEL --merge/--shift/--store``).

``target`` imports and calls the store's code; ``compare`` and ``lines`` are what every audit
shares; ``merge``, ``shift`` and ``store`` each hold one kind of target to its lines; ``run``
puts them into one :class:`~kvlab.measure.certificate.Certificate`. See ``docs/audit.md``.
"""
