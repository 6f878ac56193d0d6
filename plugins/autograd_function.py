"""autograd_function: work in progress; registers no hooks yet."""
