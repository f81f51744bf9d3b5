"""terarec.embedding"""
