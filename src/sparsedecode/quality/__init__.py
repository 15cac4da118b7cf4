"""Quality harnesses: perplexity protocols, retrieval tests, bootstrap intervals."""
