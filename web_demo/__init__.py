"""The web demo, shipped inside the wheel as package data (served at ``/``)."""
