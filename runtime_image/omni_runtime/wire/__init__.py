"""The wire: the contract between the router and the stage servers, below both.

`protocol` holds the messages (msgspec msgpack over ZeroMQ, payload tensors as raw frames), `auth` who may
send them (one key per pipeline, an HMAC-SHA256 on every message), `audio` how audio in an output is
measured (its default sample rate crosses the wire too). PROTOCOL.md next to these files is the prose
version. Nothing here imports the router, the stage server or an engine.
"""
