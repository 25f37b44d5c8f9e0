"""The fronts clients call: the gRPC generation API (`api`) and the OpenAI-compatible HTTP
front (`openai_http`, its request bodies in `openai_body` and replies in `openai_reply`), both
over the same door and scheduler."""
