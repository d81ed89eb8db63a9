"""The synthetic task (3-digit addition): its tokenizer, the exact-match evaluation, training
the shipped model and its draft, and a draft's greedy acceptance (models/synthetic/README.md)."""
