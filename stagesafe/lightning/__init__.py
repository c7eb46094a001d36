"""The Lightning side: the strategy and the machinery of one Trainer call's passage (boundary, background
writer, host memory, rank agreement). Importing it imports Lightning and DeepSpeed."""
