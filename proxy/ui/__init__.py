"""The audit page under /ui: records, the stack behind each answer, replays and their token-level diff, the live
stacks, probes, studies' reports and slice replays, served by the proxy itself from server-rendered templates.

It is a view over the proxy's own core: the audit store's record queries, the API's replay and serving path, the
registry's live stacks, and the tallies of probes, studies and slices. It owns only what a browser needs on top: sessions, CSRF tokens,
templates, and the layout of a diff or a chart. Every asset ships in this package; nothing is fetched at run time.
"""

from proxy.ui.app import ui_app

__all__ = ["ui_app"]
