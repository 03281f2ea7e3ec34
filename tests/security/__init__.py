"""Adversarial tests: hostile clients and hostile guests against real VMs."""
