"""What makes an MTP head, kept apart from engine/ (what a request runs through).

Training by self-distillation (`pdserve train-mtp`: train.py, over prompts.py, data.py and its
sampler dense_sampler.py, forward.py, loop.py, files.py); ranking the draft vocabulary
(`pdserve draft-vocab`: vocab_rank.py); measuring acceptance (acceptance.py, which `pdserve
bench acceptance` runs). The prompt lists are in prompt_lists/; the script and the loss curves
of the runs that made the shipped heads are in runs/; the heads themselves ship in
engine/model/mtp_heads/, where the loader finds them. Nothing here is used when serving.
"""
