"""terarec.train"""
