"""Requests that fit in accelerator memory per context, with and without a budget (``study``)."""
