"""kvpage on Ray Serve: replicas of the engine behind a cache-aware router.

Module map (dependencies point down; only :mod:`routing` imports nothing of Ray):

- :mod:`application`: the application (:func:`build_app`, ``serve run kvpage.ray:app``,
  ``kvpage serve --replicas``);
- :mod:`ingress`: the HTTP entry, rendering prompts' token ids for the router;
- :mod:`router`: :class:`KvpageRouter`, Ray's custom-router API over :mod:`routing`;
- :mod:`replica`: one engine and ``kvpage serve``'s app per replica;
- :mod:`routing`: the policy and each replica's cache view.

Needs ``pip install 'kvpage[ray]'``.
"""

from __future__ import annotations

from typing import Any


def app(args: dict[str, Any]) -> Any:
    """``serve run kvpage.ray:app model=MODEL replicas=N ...``
    (:func:`kvpage.ray.application.app`)."""
    from kvpage.ray.application import app as build

    return build(args)
