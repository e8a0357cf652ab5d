"""What users run: the OpenAI-compatible server, batch evaluation, and their request models."""
