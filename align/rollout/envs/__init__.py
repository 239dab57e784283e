"""Conversation environments for language-model policies: the reset/step interface, tool calling, bundled tasks."""
