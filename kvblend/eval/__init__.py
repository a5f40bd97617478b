"""Evaluation: RAG datasets, quality metrics and reports."""
