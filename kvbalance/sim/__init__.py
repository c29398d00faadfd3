"""kvbalance.sim"""
