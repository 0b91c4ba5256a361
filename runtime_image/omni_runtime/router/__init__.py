"""The router: OpenAI-compatible API in front of the stage servers; it holds no model.

Layers, each looking only down: routes -> serving classes (one per endpoint) -> orchestrator (request
state, DAG routing) -> pool/balancer -> replica clients (ZeroMQ) -> stage servers.
"""
