"""The HTTP layer: request schemas, error mapping, OpenAI-, translation- and LibreTranslate-style routes."""
