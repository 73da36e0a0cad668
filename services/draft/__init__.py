"""The draft service: proposes draft tokens for the engines' speculative decoding."""
