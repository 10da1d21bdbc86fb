"""Helpers under DeepSpeed's ``deepspeed.utils`` names: ``zero8.utils.zero_to_fp32`` (consolidated fp32
weights of an engine checkpoint, as a state_dict, into a model, or as a file)."""
