"""Opaque page tokens (AIP-158) for the list APIs, bound to the filters they were issued for
(`page_tokens`).
"""
