"""The training bootstrap that runs inside the container on every GPU node."""
