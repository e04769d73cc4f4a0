"""Helpers the tests share: fake replicas and routes, harnesses, stores, fixtures."""
