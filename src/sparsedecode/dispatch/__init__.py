"""Dispatch: latency tables, request mixes, policies and the runtime gate."""
