"""The HTTP wire schemas the API accepts and answers with (OpenAI, Anthropic); never read by workers."""
