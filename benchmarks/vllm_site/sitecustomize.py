"""Run at the start of every Python process with this folder on PYTHONPATH: the peer vLLM's
server and its engine processes load SmolVLM's processor without its video half."""

from smolvlm_without_video import without_video_processor

without_video_processor()
