"""Tool calling.

Owns the tool-call MECHANISM: parsers that find tool calls in generated text (one format per file
under `parsers/`) and the rendering of tool definitions and tool turns into a model's prompt
(`chat_format`). Server-side execution (a registry of named tools and executors with timeouts that
run under the AugServe scheduler) comes later and plugs into `tandem.server.create_app(tools=...)`.
This package must not know about HTTP or the engine.
"""
