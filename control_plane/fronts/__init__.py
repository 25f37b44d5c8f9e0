"""The fronts clients call: the gRPC generation API (`api`) and the OpenAI-compatible HTTP
front (`openai_http`, its request bodies in `openai_body` and replies in `openai_reply`), with
Anthropic's Messages API on the same port (`anthropic_messages`, its bodies in `anthropic_body`
and replies in `anthropic_reply`), all over the same door and scheduler."""
