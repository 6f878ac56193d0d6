"""grad_management: work in progress; registers no hooks yet."""
