"""efficient_attention: work in progress; registers no hooks yet."""
