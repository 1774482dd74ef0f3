"""Capture: the Recorder, what it selects, how it stages tensors and hands them to the writer."""
