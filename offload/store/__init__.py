"""Where chunk bytes live. Stores never import vLLM."""
