"""The terminal app: chat, knobs, heatmap, meters, heat inspector and sessions."""
