"""Playbook tests and replay: the service's own decisions on a scratch Redis and a virtual clock."""
