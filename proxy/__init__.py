"""stackpin's proxy: pins each OpenAI request to an exactly described serving stack and records every answer."""
