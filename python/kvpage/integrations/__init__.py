"""Adapters that plug kvpage into other libraries.

``kvpage.integrations.tunix``: :class:`~kvpage.integrations.tunix.KvpageRollout`, the
rollout engine of tunix's RL loops (``pip install kvpage[tunix]``);
``kvpage.integrations.tunix_layout``: the declared mapping of tunix's parameter layout
(no tunix import needed).
"""
