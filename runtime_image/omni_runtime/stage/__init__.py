"""The stage server: hosts one stage's engine behind the router <-> stage protocol (see wire/PROTOCOL.md)."""
