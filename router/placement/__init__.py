"""Placement: where each request's prompt is prefilled and which actors serve it (no Ray).

    policies         prefill / decode choice among candidates (cached prefix vs load)
    auto             routing.mode auto: remote prefill + transfer vs chunked prefill on the decode actor
    live_profile     the performance model the router and the autoscaler ask, corrected by what requests report
    kv_index         which actors' prefix caches hold which block hashes (from their own events)
    kv_event_poller  pulls those events into the index
    placer           the decisions the dispatcher and its attempts ask for, over all of the above
"""
from router.placement.auto import Choice, Placement, ShadowPrefill, place
from router.placement.kv_event_poller import KVEventPoller
from router.placement.kv_index import KVIndex
from router.placement.live_profile import LiveProfile
from router.placement.placer import Placer, PlacementRecord
from router.placement.policies import DECODE_POLICIES, PREFILL_POLICIES, pick_decode, pick_prefill

__all__ = ["Choice", "DECODE_POLICIES", "KVEventPoller", "KVIndex", "LiveProfile", "PREFILL_POLICIES", "Placement",
           "Placer", "PlacementRecord", "ShadowPrefill", "pick_decode", "pick_prefill", "place"]
